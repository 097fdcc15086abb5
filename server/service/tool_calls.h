// Tool calling for chat requests (issue 44): rendering a conversation with
// tool definitions, assistant tool calls and tool results into the model's
// prompt, and parsing the model's tool calls back out of its text, whole or
// as a stream.
//
// Rendering: a template that handles tools itself (its source mentions
// `tools` or `tool_calls`, as Qwen's and Llama 3's do) gets them as Hugging
// Face's apply_chat_template gives them: the `tools` variable and each
// message's tool_calls / tool_call_id. A template that does not (SmolLM2's
// plain ChatML) would drop them silently, so kvserve writes them into the
// messages in the Hermes convention that ChatML tool models use: the
// catalogue in the system turn inside <tools></tools>, each call as
// <tool_call>{"name", "arguments"}</tool_call> in the assistant turn, each
// result inside <tool_response></tool_response> in a tool turn. The
// developer role is the system role unless the template names it.
//
// Parsing: the model's <tool_call>{json}</tool_call> blocks become OpenAI
// tool_calls; text outside them is the content. A block whose JSON is not a
// {"name", "arguments"} object is left in the content as the model wrote
// it, so nothing the model said is lost.
//
// Thread-safety: pure functions; a ToolCallStreamer belongs to one stream.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "model/chat_template.h"

namespace kvserve {

struct ToolCall {
  std::string id;         // call_...
  std::string name;       // the function's name
  std::string arguments;  // a JSON text (an object, as OpenAI sends it)
};

// True when the conversation needs the tool rendering (tools given, or a
// tool / developer turn, or an assistant turn with tool calls).
bool NeedsToolRendering(const std::vector<ChatMessage>& messages, const std::string& tools_json);

// Renders `messages` and `tools_json` (a JSON array of OpenAI tool objects,
// "" for none) with the generation prompt, as the file comment says.
absl::StatusOr<std::string> RenderChatWithTools(const ChatTemplate& t,
                                                std::vector<ChatMessage> messages,
                                                const std::string& tools_json);

// The catalogue kvserve writes into the system turn (Hermes convention).
std::string HermesToolsPrompt(const std::string& tools_json);

struct ParsedToolCalls {
  std::string content;  // the text outside the calls, trimmed; may be empty
  std::vector<ToolCall> calls;
};

// Parses a whole reply. parallel false keeps only the first call.
ParsedToolCalls ParseToolCalls(std::string_view text, bool parallel);

// Splits a streamed reply into content deltas and whole tool calls as they
// complete. A possible start of a <tool_call> tag is held back until it is
// known; so is whitespace, which is dropped between and after calls.
class ToolCallStreamer {
 public:
  explicit ToolCallStreamer(bool parallel) : parallel_(parallel) {}
  // The content to send now; completed calls are appended to `calls`.
  std::string Feed(std::string_view text, std::vector<ToolCall>* calls);
  // At the end of the reply: what is left (an unclosed block whose JSON is a
  // call is one; anything else is content).
  std::string Finish(std::vector<ToolCall>* calls);
  int32_t num_calls() const { return num_calls_; }

 private:
  std::string Content(std::string text, bool final);
  void AddCall(ToolCall call, std::vector<ToolCall>* calls);

  bool parallel_;
  bool inside_ = false;
  std::string buffer_;   // undecided text
  std::string pending_;  // whitespace-only content held back
  bool sent_content_ = false;
  int32_t num_calls_ = 0;
};

}  // namespace kvserve

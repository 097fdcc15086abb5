// CompletedResponse: everything a finished completion is made of, as both
// front ends build it from the engine's SeqEvents: per sample the token ids,
// log-probabilities, text, finish reason and tokens evicted, and for the
// request the token counts a usage block reports. The gRPC stream, the HTTP non-streaming and
// streaming replies and `kvserve generate` all aggregate events through one
// ResponseAccumulator, so they cannot disagree on what a reply contains, and
// a response cache can store a CompletedResponse and replay it. The reply's
// envelope (an HTTP id, the creation time, echoed prompt text) belongs to
// each front end and is not stored here.
//
// Thread-safety: CompletedResponse and CompletedSample are plain data.
// ResponseAccumulator is thread-safe: Add runs on the engine thread while a
// front end's thread may call done(), Snapshot() or Take().
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "scheduler/request.h"

namespace kvserve {

// One of a request's n samples.
struct CompletedSample {
  int32_t index = 0;                          // in [0, n)
  std::vector<int32_t> token_ids;             // in the order the engine produced them
  std::vector<float> logprobs;                // one per token when the request asked for them
  std::string text;                           // the concatenated event texts
  FinishReason finish = FinishReason::kNone;  // kNone while the sample is open
  int32_t completion_tokens = 0;              // the engine's count (the most any event reported)
  int32_t dropped_tokens = 0;                 // evicted by the kv_policy (the most reported)
};

struct CompletedResponse {
  uint64_t request_id = 0;               // the engine's id (from the events)
  std::vector<CompletedSample> samples;  // samples[i].index == i
  int32_t prompt_tokens = 0;
  int32_t cached_tokens = 0;      // prompt tokens served from the prefix cache (the most reported)
  // Of cached_tokens, loaded from the host and the disk KV tier.
  int32_t cached_host_tokens = 0;
  int32_t cached_disk_tokens = 0;
  // Of cached_tokens, K/V a KV tier re-encoded lossily (--kv-host-dtype);
  // lossy_kv: some sample ran on such K/V. Either makes the reply inexact:
  // the response cache never stores it (StorableResponse).
  int32_t cached_lossy_tokens = 0;
  bool lossy_kv = false;
  int64_t completion_tokens = 0;  // summed over the samples
  int64_t dropped_tokens = 0;     // evicted by the kv_policy, summed over the samples
  // Of a draft the engine verified (a semantic-verified cache hit), the
  // tokens the model kept (the most any event reported).
  int32_t draft_accepted = 0;
  // The last cancelled or deadline finish of any sample, else kNone: a reply
  // with it set was cut short by the server or the deadline, not the model.
  FinishReason abort_reason = FinishReason::kNone;

  bool aborted() const { return abort_reason != FinishReason::kNone; }
};

// Folds one request's events into a CompletedResponse. Events of a sample
// must be added in the order the engine emitted them (the engine calls its
// callback from one thread, in order); samples may interleave freely.
class ResponseAccumulator {
 public:
  // `n` samples (at least 1); `prompt_tokens` stands until an event reports
  // its own count.
  ResponseAccumulator(int32_t n, int32_t prompt_tokens);

  ResponseAccumulator(const ResponseAccumulator&) = delete;
  ResponseAccumulator& operator=(const ResponseAccumulator&) = delete;

  // Appends the event's tokens, log-probabilities and text to its sample.
  // Returns true when this event finished its sample (its first finish). An
  // event whose index is outside [0, n) only contributes its token counts;
  // events after Take() are ignored.
  bool Add(const SeqEvent& event);

  // Every sample has its finish reason.
  bool done() const;
  // Bytes of text sample `index` has so far (0 for an index outside [0, n)).
  size_t text_size(int32_t index) const;

  // A copy of what has been gathered so far.
  CompletedResponse Snapshot() const;
  // Moves the response out; later events are ignored.
  // REQUIRES: done(), and Take() not called before.
  CompletedResponse Take();

 private:
  mutable absl::Mutex mu_;
  CompletedResponse response_ ABSL_GUARDED_BY(mu_);
  int32_t open_samples_ ABSL_GUARDED_BY(mu_);
  bool taken_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvserve

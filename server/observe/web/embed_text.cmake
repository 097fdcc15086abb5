# Turns a text file into a C++ header holding it as one string constant:
#   cmake -DINPUT=page.html -DOUTPUT=page_html.h -DNAME=kPageHtml -P embed_text.cmake
# The page is compiled into the binary, so the daemon serves it with no file
# on disk and the browser fetches nothing else (no CDN).
file(READ "${INPUT}" content)
string(FIND "${content}" ")KVSERVE_EMBED\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${INPUT} contains the raw-string delimiter )KVSERVE_EMBED\"")
endif()
file(WRITE "${OUTPUT}.tmp"
  "// Generated from ${INPUT} by embed_text.cmake; do not edit.\n#pragma once\n"
  "namespace kvserve {\ninline constexpr char ${NAME}[] = R\"KVSERVE_EMBED(${content})KVSERVE_EMBED\";\n}\n")
file(COPY_FILE "${OUTPUT}.tmp" "${OUTPUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUTPUT}.tmp")

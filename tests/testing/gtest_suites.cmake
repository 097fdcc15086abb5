# Registers a GoogleTest executable with CTest one test per test suite
# (`Suite.*`) instead of one per case: for the executables with thousands of
# parameterized cases (kernels_test, quants_test, cuda_kernels_test), where
# starting a process per case cost more than the cases (a CUDA test process
# loads cuBLAS: ~0.09 CPU s and 0.18 s wall each, 607 of them). Every case
# still runs; a failing case fails its suite, and the log names it.
#
# Two modes. Included from tests/CMakeLists.txt, it defines
# kvserve_gtest_suites(<target> LABELS <labels>), which lists the suites
# after each build (like gtest_discover_tests' POST_BUILD mode). Run with
# cmake -P (EXE, OUT, LABELS, RUNNER set), it writes OUT's add_test() lines.
if(CMAKE_SCRIPT_MODE_FILE)
  execute_process(COMMAND "${EXE}" --gtest_list_tests OUTPUT_VARIABLE out
    RESULT_VARIABLE rc TIMEOUT 60)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${EXE} --gtest_list_tests failed (${rc}): ${out}")
  endif()
  string(REPLACE "\n" ";" lines "${out}")
  set(content "")
  foreach(line IN LISTS lines)
    # Suite lines end in '.' (a typed suite's comment after two spaces).
    if(line MATCHES "^([A-Za-z_][A-Za-z0-9_/]*)\\.(  #.*)?$")
      set(t "${CMAKE_MATCH_1}.*")
      string(APPEND content "add_test([=[${t}]=] [=[${RUNNER}]=] [=[${EXE}]=] "
        "[=[--gtest_filter=${t}]=] --gtest_brief=1)\n"
        "set_tests_properties([=[${t}]=] PROPERTIES LABELS [=[${LABELS}]=] SKIP_RETURN_CODE 77)\n")
    endif()
  endforeach()
  file(WRITE "${OUT}" "${content}")
  return()
endif()

set(_kvserve_gtest_suites_script "${CMAKE_CURRENT_LIST_FILE}")
function(kvserve_gtest_suites target)
  cmake_parse_arguments(S "" "" "LABELS" ${ARGN})
  set(out "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites.cmake")
  set(inc "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites_include.cmake")
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND ${CMAKE_COMMAND} -D "EXE=$<TARGET_FILE:${target}>" -D "OUT=${out}"
            -D "LABELS=${S_LABELS}" -D "RUNNER=${PROJECT_SOURCE_DIR}/tests/testing/run_suite.sh"
            -P "${_kvserve_gtest_suites_script}"
    BYPRODUCTS "${out}" VERBATIM)
  file(WRITE "${inc}"
    "if(EXISTS [=[${out}]=])\n  include([=[${out}]=])\nelse()\n"
    "  add_test([=[${target}_NOT_BUILT]=] [=[${target}_NOT_BUILT]=])\nendif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${inc}")
endfunction()

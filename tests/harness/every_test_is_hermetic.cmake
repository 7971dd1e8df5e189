# cmake -D CTEST=<ctest> -D BUILD_DIR=<build tree> -D WRAPPER=<tests/hermetic.sh> -P this file
# Fails, naming them, when any test of BUILD_DIR runs a command that does not start with WRAPPER:
# such a test would see the invoking user's HOME and TMPDIR.
execute_process(COMMAND ${CTEST} --test-dir ${BUILD_DIR} --show-only=json-v1
                OUTPUT_VARIABLE json RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "[tests] ctest --show-only=json-v1 in ${BUILD_DIR} failed (${rc}): ${err}")
endif()
string(JSON count LENGTH "${json}" tests)
get_filename_component(wrapper "${WRAPPER}" REALPATH)
set(unwrapped "")
math(EXPR last "${count} - 1")
foreach(i RANGE ${last})
  string(JSON name GET "${json}" tests ${i} name)
  string(JSON first ERROR_VARIABLE no_command GET "${json}" tests ${i} command 0)
  if(no_command)
    set(first "")
  else()
    get_filename_component(first "${first}" REALPATH)
  endif()
  if(NOT first STREQUAL wrapper)
    list(APPEND unwrapped "${name}")
  endif()
endforeach()
list(LENGTH unwrapped n)
if(n GREATER 0)
  list(JOIN unwrapped "\n  " names)
  message(FATAL_ERROR
    "[tests] ${n} of ${count} tests do not run through ${WRAPPER}, so they see the user's HOME "
    "and TMPDIR:\n  ${names}\nPrefix \${TETRA_HERMETIC} to their add_test COMMAND "
    "(tests/CMakeLists.txt).")
endif()
message(STATUS "all ${count} tests run through ${WRAPPER}")

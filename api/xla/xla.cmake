# The XLA FFI handlers (api/xla/handlers.cpp) are built when XLA's FFI headers are found: given as
# KSPEC_XLA_FFI_INCLUDE, or asked of jax (jax.ffi.include_dir()) through KSPEC_PYTHON (default: the
# Python scikit-build-core builds with, else python3 on PATH; tools/test.sh passes its $PYTHON). Without
# them kspec builds the stubs (api/xla/no_xla.cpp): kspec_xla_register then returns KSPEC_ERROR_UNSUPPORTED
# saying why.
option(KSPEC_XLA "Build the XLA FFI handlers when XLA's FFI headers are found" ON)
set(KSPEC_XLA_FFI_INCLUDE "" CACHE PATH "Directory holding xla/ffi/api/ffi.h (empty: ask jax)")
set(KSPEC_XLA_BUILT OFF)
if(KSPEC_XLA)
  set(_kspec_xla_inc "${KSPEC_XLA_FFI_INCLUDE}")
  if(NOT _kspec_xla_inc)
    if(KSPEC_PYTHON)
      set(_kspec_py "${KSPEC_PYTHON}")
    elseif(Python3_EXECUTABLE)  # scikit-build-core's interpreter
      set(_kspec_py "${Python3_EXECUTABLE}")
    elseif(Python_EXECUTABLE)
      set(_kspec_py "${Python_EXECUTABLE}")
    else()
      find_program(_kspec_py NAMES python3 python)
    endif()
    if(_kspec_py)
      execute_process(COMMAND "${_kspec_py}" -c "import jax.ffi; print(jax.ffi.include_dir())"
                      OUTPUT_VARIABLE _kspec_xla_inc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
                      RESULT_VARIABLE _kspec_rc)
      if(NOT _kspec_rc EQUAL 0)
        set(_kspec_xla_inc "")
      endif()
    endif()
  endif()
  if(_kspec_xla_inc AND EXISTS "${_kspec_xla_inc}/xla/ffi/api/ffi.h")
    set(KSPEC_XLA_BUILT ON)
    set(KSPEC_XLA_INCLUDE_DIR "${_kspec_xla_inc}")
  endif()
endif()
target_sources(kspec PRIVATE ${CMAKE_CURRENT_LIST_DIR}/targets.cpp)
if(KSPEC_XLA_BUILT)
  message(STATUS "kspec: XLA FFI handlers built (headers: ${KSPEC_XLA_INCLUDE_DIR})")
  target_sources(kspec PRIVATE ${CMAKE_CURRENT_LIST_DIR}/handlers.cpp)
  # SYSTEM: XLA's headers are not held to kspec's warning flags.
  target_include_directories(kspec SYSTEM PRIVATE "${KSPEC_XLA_INCLUDE_DIR}")
else()
  message(STATUS "kspec: XLA FFI handlers not built (no xla/ffi/api/ffi.h: install jax or set KSPEC_XLA_FFI_INCLUDE)")
  target_sources(kspec PRIVATE ${CMAKE_CURRENT_LIST_DIR}/no_xla.cpp)
endif()

# kspec._torch_ext, the optional torch C++ extension: built only when the Python that builds kspec can
# import torch (tools/install.sh installs with --no-build-isolation, so that is the user's torch; CI
# without torch skips it and kspec works as before). It is compiled against that torch's headers and
# C++ ABI and links its libraries, but not kspec: it calls kspec._C's C ABI (python/src/ext_api.h).
execute_process(
  COMMAND ${Python_EXECUTABLE} -c
          "import os, torch; r = os.path.dirname(torch.__file__); print(r + ';' + str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))"
  RESULT_VARIABLE KSPEC_TORCH_RC OUTPUT_VARIABLE KSPEC_TORCH_INFO ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT KSPEC_TORCH_RC EQUAL 0)
  message(STATUS "kspec: torch is not importable by ${Python_EXECUTABLE}: kspec._torch_ext is not built")
  return()
endif()
list(GET KSPEC_TORCH_INFO 0 KSPEC_TORCH_DIR)
list(GET KSPEC_TORCH_INFO 1 KSPEC_TORCH_CXX11_ABI)
message(STATUS "kspec: building kspec._torch_ext against ${KSPEC_TORCH_DIR}")
set(KSPEC_TORCH_LIBS)
foreach(lib c10 c10_cuda torch_cpu torch_python)
  find_library(KSPEC_TORCH_LIB_${lib} ${lib} PATHS ${KSPEC_TORCH_DIR}/lib NO_DEFAULT_PATH REQUIRED)
  list(APPEND KSPEC_TORCH_LIBS ${KSPEC_TORCH_LIB_${lib}})
endforeach()
Python_add_library(_torch_ext MODULE WITH_SOABI python/src/torch_ext/module.cpp)
# torch's headers as system headers: their own warnings are not kspec's to fix
target_include_directories(_torch_ext SYSTEM PRIVATE ${KSPEC_TORCH_DIR}/include
                           ${KSPEC_TORCH_DIR}/include/torch/csrc/api/include ${CUDAToolkit_INCLUDE_DIRS})
target_include_directories(_torch_ext PRIVATE ${CMAKE_CURRENT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR}/api/include
                           ${CMAKE_CURRENT_SOURCE_DIR}/jit/base/include)
target_compile_definitions(_torch_ext PRIVATE _GLIBCXX_USE_CXX11_ABI=${KSPEC_TORCH_CXX11_ABI})
# The C++ standard torch's headers need: C++20 where its own CMake config asks for it (torch 2.15's headers use
# <=> and concepts), else the project's C++17.
set(KSPEC_TORCH_CONFIG "${KSPEC_TORCH_DIR}/share/cmake/Torch/TorchConfig.cmake")
set(KSPEC_TORCH_CXX20)
if(EXISTS "${KSPEC_TORCH_CONFIG}")
  file(STRINGS "${KSPEC_TORCH_CONFIG}" KSPEC_TORCH_CXX20 REGEX "cxx_std_20")
endif()
if(KSPEC_TORCH_CXX20)
  set_target_properties(_torch_ext PROPERTIES CXX_STANDARD 20)
endif()
target_compile_options(_torch_ext PRIVATE ${KSPEC_WARNINGS})
target_link_libraries(_torch_ext PRIVATE ${KSPEC_TORCH_LIBS})
set_target_properties(_torch_ext PROPERTIES BUILD_RPATH "${KSPEC_TORCH_DIR}/lib"
                      INSTALL_RPATH "${KSPEC_TORCH_DIR}/lib;${CUDAToolkit_LIBRARY_DIR}")
if(SKBUILD)
  install(TARGETS _torch_ext LIBRARY DESTINATION kspec)
endif()

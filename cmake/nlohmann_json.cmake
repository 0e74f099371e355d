# nlohmann/json (header-only) for kspec's metadata and tuning database. Looked for, in order: an installed
# CMake package (Debian's nlohmann-json3-dev, a conda or vcpkg prefix, -Dnlohmann_json_DIR), then the
# headers of PyPI's `nlohmann-json` package in the Python that builds (pyproject.toml's build requirement,
# so `pip install .` with build isolation needs nothing from apt). Nothing is downloaded at configure time:
# a build without network must behave like one with it. Defines nlohmann_json::nlohmann_json.
find_package(nlohmann_json 3 QUIET)
if(NOT nlohmann_json_FOUND)
  if(NOT Python_EXECUTABLE)
    find_package(Python 3 COMPONENTS Interpreter QUIET)
  endif()
  set(_kspec_json_include "")
  if(Python_EXECUTABLE)
    # find_spec locates the package without importing it (its __init__ needs importlib_resources).
    execute_process(
      COMMAND ${Python_EXECUTABLE} -c
        "import importlib.util as u, os; s = u.find_spec('nlohmann_json'); print(os.path.join(list(s.submodule_search_locations)[0], 'include') if s else '')"
      OUTPUT_VARIABLE _kspec_json_include OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  if(_kspec_json_include AND EXISTS "${_kspec_json_include}/nlohmann/json.hpp")
    message(STATUS "nlohmann_json: headers of the Python package nlohmann-json at ${_kspec_json_include}")
    add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED)
    set_target_properties(nlohmann_json::nlohmann_json PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_kspec_json_include}")
  else()
    message(FATAL_ERROR
      "kspec needs nlohmann/json 3.x (header-only) and found neither its CMake package nor the Python package "
      "nlohmann-json (looked with ${Python_EXECUTABLE}). Install one of:\n"
      "  apt-get install nlohmann-json3-dev           (Debian/Ubuntu)\n"
      "  python3 -m pip install nlohmann-json         (into the Python that builds; pip install . does this itself)\n"
      "or point -Dnlohmann_json_DIR at a directory holding nlohmann_jsonConfig.cmake.")
  endif()
endif()

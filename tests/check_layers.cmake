# The layering rule, checked: templates → jit/base → jit → cache → api → python → tools, and a file may
# include only its own layer or a lower one. Each #include is resolved as the compiler would (the
# including file's folder, then the include directories of its layer) and the resolved file's layer
# compared with the includer's; includes that resolve to no file in the tree (system, toolkit) are skipped.
# One more rule: cache/ reads no environment (api builds the disk cache from the knobs), so it may not
# include the knobs.
#   cmake -DROOT=<repo> -P tests/check_layers.cmake        fails listing every include that goes upward
#   cmake -DSELF_TEST=<dir> -P tests/check_layers.cmake    builds a small tree with known violations in
#                                                          <dir> and fails unless exactly those are found
cmake_minimum_required(VERSION 3.24)

set(KSPEC_LAYERS templates jit/base jit cache api python tools)

# The layer index of a path relative to the root, or -1 outside every layer (tests/, build/...).
function(layer_of rel out)
  set(best -1)
  set(best_len 0)
  set(i 0)
  foreach(layer IN LISTS KSPEC_LAYERS)
    string(LENGTH "${layer}/" n)
    string(SUBSTRING "${rel}" 0 ${n} head)
    if(head STREQUAL "${layer}/" AND n GREATER best_len)
      set(best ${i})
      set(best_len ${n})
    endif()
    math(EXPR i "${i} + 1")
  endforeach()
  set(${out} ${best} PARENT_SCOPE)
endfunction()

# Appends "<file> (<layer>) includes <target> (<layer>)" for every upward include under root to out.
function(check_layers root out)
  set(found "")
  # NVRTC sees only the templates; the host code sees the library's include directories.
  set(host_dirs "${root}" "${root}/jit/base/include" "${root}/api/include" "${root}/api/ops")
  set(globs "")
  foreach(layer IN LISTS KSPEC_LAYERS)
    foreach(ext h hpp cuh cpp cc cu)
      list(APPEND globs "${root}/${layer}/*.${ext}")
    endforeach()
  endforeach()
  file(GLOB_RECURSE files LIST_DIRECTORIES false ${globs})
  list(REMOVE_DUPLICATES files)
  foreach(f IN LISTS files)
    file(RELATIVE_PATH rel "${root}" "${f}")
    layer_of("${rel}" from)
    if(from LESS 0)
      continue()
    endif()
    get_filename_component(here "${f}" DIRECTORY)
    if(rel MATCHES "^templates/")
      set(dirs "${here}" "${root}/templates")
    else()
      set(dirs "${here}" ${host_dirs})
    endif()
    file(STRINGS "${f}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<][^\">]+[\">]")
    foreach(line IN LISTS lines)
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*[\"<]([^\">]+)[\">].*$" "\\1" inc "${line}")
      foreach(d IN LISTS dirs)
        if(EXISTS "${d}/${inc}" AND NOT IS_DIRECTORY "${d}/${inc}")
          file(REAL_PATH "${d}/${inc}" target)
          file(REAL_PATH "${root}" real_root)
          file(RELATIVE_PATH target_rel "${real_root}" "${target}")
          layer_of("${target_rel}" to)
          if(rel MATCHES "^cache/" AND target_rel STREQUAL "jit/base/include/kspec/knobs.h")
            list(APPEND found "${rel} (cache) includes ${target_rel}: the cache is given its settings by api")
          elseif(to GREATER from)
            list(GET KSPEC_LAYERS ${from} from_name)
            list(GET KSPEC_LAYERS ${to} to_name)
            list(APPEND found "${rel} (${from_name}) includes ${target_rel} (${to_name})")
          endif()
          break()
        endif()
      endforeach()
    endforeach()
  endforeach()
  set(${out} "${found}" PARENT_SCOPE)
endfunction()

if(DEFINED SELF_TEST)
  file(REMOVE_RECURSE "${SELF_TEST}")
  file(WRITE "${SELF_TEST}/api/src/op.h" "#pragma once\n")
  file(WRITE "${SELF_TEST}/api/include/kspec/registry.h" "#pragma once\n#include \"kspec/error.h\"\n")
  file(WRITE "${SELF_TEST}/jit/base/include/kspec/error.h" "#pragma once\n")
  file(WRITE "${SELF_TEST}/jit/base/include/kspec/knobs.h" "#pragma once\n")
  file(WRITE "${SELF_TEST}/cache/lock.cpp" "#include \"kspec/error.h\"\n#include <kspec/knobs.h>\n")
  file(WRITE "${SELF_TEST}/jit/base/log.h" "#pragma once\n#include \"jit/spec.h\"\n")
  file(WRITE "${SELF_TEST}/jit/spec.h" "#pragma once\n#include \"kspec/error.h\"\n#include <string>\n")
  file(WRITE "${SELF_TEST}/jit/spec.cpp"
       "#include \"spec.h\"\n  #  include <kspec/registry.h>\nos << \"#include \\\"x.h\\\"\";\n")
  file(WRITE "${SELF_TEST}/cache/disk_cache.cpp" "#include \"jit/spec.h\"\n#include \"api/src/op.h\"\n")
  file(WRITE "${SELF_TEST}/templates/common/math.cuh" "#pragma once\n")
  file(WRITE "${SELF_TEST}/templates/scan/scan.cuh" "#include \"common/math.cuh\"\n")
  check_layers("${SELF_TEST}" found)
  set(expected
      "cache/disk_cache.cpp (cache) includes api/src/op.h (api)"
      "cache/lock.cpp (cache) includes jit/base/include/kspec/knobs.h: the cache is given its settings by api"
      "jit/base/log.h (jit/base) includes jit/spec.h (jit)"
      "jit/spec.cpp (jit) includes api/include/kspec/registry.h (api)")
  list(SORT found)
  if(NOT found STREQUAL expected)
    string(REPLACE ";" "\n  " got "${found}")
    message(FATAL_ERROR "check_layers self-test: expected the four planted violations, found:\n  ${got}")
  endif()
  message(STATUS "check_layers self-test: the four planted violations found, nothing else")
else()
  check_layers("${ROOT}" found)
  if(found)
    string(REPLACE ";" "\n  " lines "${found}")
    message(FATAL_ERROR "a lower layer includes a higher one (templates → jit/base → jit → cache → api → "
                        "python → tools), or the cache includes the knobs:\n  ${lines}")
  endif()
  message(STATUS "layers: no file includes a higher layer")
endif()

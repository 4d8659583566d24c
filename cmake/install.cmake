# Install rules (`cmake --install build`): what an operator and an engine developer get on a host, in the layout the
# systemd units and the Python package expect; cmake/deb_package.cmake turns the same rules into a Debian package.
#
# Layout (prefix /usr, the default here because flexkvd.service runs /usr/bin/flexkvd):
#   bin/flexkvd flexkvctl flexkv-bench                  lib/<multiarch>/libflexkv.so.0 (+ .so, .pc, cmake/flexkv/)
#   include/flexkv/*.h            the public headers only (client/include/flexkv, common/include/flexkv)
#   lib/python3/dist-packages/flexkvd                     the Python package (finds libflexkv.so.0 through ld.so)
#   lib/systemd/system, lib/sysusers.d, lib/tmpfiles.d   units and snippets
#   /etc/flexkvd/flexkvd.toml                            the example config (a conffile in the package)
#   share/man/man8, share/doc/flexkvd (+ examples/engine_cmake)
# With another prefix (--prefix /usr/local), ExecStart= and Documentation= in the installed units follow it.
if(CMAKE_INSTALL_PREFIX_INITIALIZED_TO_DEFAULT)
  set(CMAKE_INSTALL_PREFIX /usr CACHE PATH "Install prefix (flexkvd.service expects /usr)" FORCE)
endif()
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(FLEXKV_INSTALL_SYSCONFDIR /etc CACHE PATH "Where flexkvd/flexkvd.toml goes (the unit reads /etc/flexkvd)")
set(FLEXKV_INSTALL_PYTHONDIR lib/python3/dist-packages CACHE PATH
    "Where the Python package goes, relative to the prefix (Debian's python3 reads <prefix>/lib/python3/dist-packages)")
set(FLEXKV_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/flexkv)
set(FLEXKV_INSTALL_DOCDIR ${CMAKE_INSTALL_DATAROOTDIR}/doc/flexkvd)  # the package's name, as the units' Documentation=

# --- Binaries and the client library -------------------------------------------------------------------------------
# flexkv-bench starts the flexkvd next to it, so both go to bin/. Test programs are never installed.
install(TARGETS flexkvd flexkvctl flexkv-bench RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# libflexkv.so.<version>, its SONAME link libflexkv.so.0 (what programs load) and libflexkv.so (what -lflexkv links).
install(TARGETS flexkv LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
# Public headers: exactly these directories (they include only the standard library and each other).
install(DIRECTORY ${PROJECT_SOURCE_DIR}/client/include/flexkv ${PROJECT_SOURCE_DIR}/common/include/flexkv
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")

# pkg-config and the CMake package. The .pc file takes the prefix in effect at install time (cpack installs to /usr
# whatever the build was configured with), the CMake package config is relocatable (paths from its own location).
install(CODE "
  set(prefix \"\${CMAKE_INSTALL_PREFIX}\")
  set(libdir \"${CMAKE_INSTALL_LIBDIR}\")
  set(includedir \"${CMAKE_INSTALL_INCLUDEDIR}\")
  set(version \"${PROJECT_VERSION}\")
  configure_file(\"${CMAKE_CURRENT_LIST_DIR}/flexkv.pc.in\" \"${PROJECT_BINARY_DIR}/install/flexkv.pc\" @ONLY)")
install(FILES ${PROJECT_BINARY_DIR}/install/flexkv.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/flexkvConfig.cmake.in
  ${PROJECT_BINARY_DIR}/install/flexkvConfig.cmake
  INSTALL_DESTINATION ${FLEXKV_INSTALL_CMAKEDIR}
  PATH_VARS CMAKE_INSTALL_LIBDIR CMAKE_INSTALL_INCLUDEDIR)
# 0.x: a new minor version may change the API, so only the same major.minor satisfies find_package(flexkv 0.1).
write_basic_package_version_file(${PROJECT_BINARY_DIR}/install/flexkvConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/install/flexkvConfig.cmake ${PROJECT_BINARY_DIR}/install/flexkvConfigVersion.cmake
        DESTINATION ${FLEXKV_INSTALL_CMAKEDIR})

# --- Python package ------------------------------------------------------------------------------------------------
# Pure Python over libflexkv.so.0, which it loads through the system loader from the library directory above (see
# python/flexkvd/_lib.py). Sources only: no __pycache__ (the package's postinst byte-compiles, its prerm cleans up).
install(DIRECTORY ${PROJECT_SOURCE_DIR}/python/flexkvd DESTINATION ${FLEXKV_INSTALL_PYTHONDIR}
        FILES_MATCHING PATTERN "*.py" PATTERN "py.typed" PATTERN "__pycache__" EXCLUDE)
# A compiled extension of the package, when this build has one: every MODULE library of the project outside tests/
# is one (Python3_add_library makes MODULE libraries), installed into the package beside its .py files.
function(flexkv_python_modules dir out)
  set(found "")
  get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  foreach(target IN LISTS targets)
    get_target_property(type ${target} TYPE)
    if(type STREQUAL "MODULE_LIBRARY")
      list(APPEND found ${target})
    endif()
  endforeach()
  get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(subdir IN LISTS subdirs)
    if(NOT subdir MATCHES "^${PROJECT_SOURCE_DIR}/tests(/|$)")
      flexkv_python_modules(${subdir} sub_found)
      list(APPEND found ${sub_found})
    endif()
  endforeach()
  set(${out} ${found} PARENT_SCOPE)
endfunction()
flexkv_python_modules(${PROJECT_SOURCE_DIR} FLEXKV_PYTHON_MODULES)
if(FLEXKV_PYTHON_MODULES)
  install(TARGETS ${FLEXKV_PYTHON_MODULES} LIBRARY DESTINATION ${FLEXKV_INSTALL_PYTHONDIR}/flexkvd)
  message(STATUS "flexkv: installs the Python extension(s) ${FLEXKV_PYTHON_MODULES}")
endif()

# --- systemd units, sysusers and tmpfiles snippets, config -------------------------------------------------------
# The units name /usr/bin/flexkvd and /usr/share/doc/flexkvd; rewritten at install time for another prefix.
foreach(unit flexkvd.service flexkvd.socket)
  install(CODE "
    file(READ \"${PROJECT_SOURCE_DIR}/systemd/${unit}\" text)
    string(REPLACE \"/usr/bin/flexkvd\" \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_BINDIR}/flexkvd\" text \"\${text}\")
    string(REPLACE \"/usr/share/doc/flexkvd\" \"\${CMAKE_INSTALL_PREFIX}/${FLEXKV_INSTALL_DOCDIR}\" text \"\${text}\")
    file(WRITE \"${PROJECT_BINARY_DIR}/install/${unit}\" \"\${text}\")")
  install(FILES ${PROJECT_BINARY_DIR}/install/${unit} DESTINATION lib/systemd/system)
endforeach()
install(FILES ${PROJECT_SOURCE_DIR}/systemd/flexkvd.sysusers DESTINATION lib/sysusers.d RENAME flexkvd.conf)
install(FILES ${PROJECT_SOURCE_DIR}/systemd/flexkvd.tmpfiles DESTINATION lib/tmpfiles.d RENAME flexkvd.conf)
install(FILES ${PROJECT_SOURCE_DIR}/systemd/flexkvd.toml DESTINATION ${FLEXKV_INSTALL_SYSCONFDIR}/flexkvd)

# --- Man pages and documentation --------------------------------------------------------------------------------
# flexkvd.8 and flexkvctl.8 from the programs' own --help (help2man, Debian package help2man), gzipped as Debian
# ships man pages. Without help2man there are none (a note at configure time).
find_program(HELP2MAN_EXECUTABLE help2man)
find_program(GZIP_EXECUTABLE gzip)
if(HELP2MAN_EXECUTABLE AND GZIP_EXECUTABLE)
  set(man_pages "")
  foreach(entry "flexkvd|node-local KV-cache daemon for LLM inference engines"
                "flexkvctl|inspect, drain and resume a running flexkvd")
    string(REPLACE "|" ";" entry "${entry}")
    list(GET entry 0 program)
    list(GET entry 1 what)
    set(page ${PROJECT_BINARY_DIR}/man/${program}.8)
    add_custom_command(OUTPUT ${page}.gz
      COMMAND ${CMAKE_COMMAND} -E make_directory ${PROJECT_BINARY_DIR}/man
      COMMAND ${HELP2MAN_EXECUTABLE} --no-info --section=8 --name=${what} --version-string=${PROJECT_VERSION}
              --output=${page} $<TARGET_FILE:${program}>
      COMMAND ${GZIP_EXECUTABLE} -9nf ${page}
      DEPENDS ${program}
      COMMENT "help2man: ${program}.8"
      VERBATIM)
    list(APPEND man_pages ${page}.gz)
  endforeach()
  add_custom_target(flexkv_man ALL DEPENDS ${man_pages})
  install(FILES ${man_pages} DESTINATION ${CMAKE_INSTALL_MANDIR}/man8)
else()
  message(STATUS "flexkv: no help2man (Debian: help2man): no man pages are installed")
endif()

# flexkvctl's bash completion, printed by the program from its own CLI definitions (`flexkvctl completion bash`),
# where bash-completion loads it on demand. Only with a flexkvctl that has that subcommand (completion.cc).
if(EXISTS ${PROJECT_SOURCE_DIR}/client/flexkvctl/completion.cc)
  set(FLEXKV_BASH_COMPLETION ${PROJECT_BINARY_DIR}/install/flexkvctl.bash)
  add_custom_command(OUTPUT ${FLEXKV_BASH_COMPLETION}
    COMMAND sh -c "\"$1\" completion bash > \"$2\"" flexkvctl-completion $<TARGET_FILE:flexkvctl>
            ${FLEXKV_BASH_COMPLETION}
    DEPENDS flexkvctl
    COMMENT "flexkvctl completion bash"
    VERBATIM)
  add_custom_target(flexkv_completion ALL DEPENDS ${FLEXKV_BASH_COMPLETION})
  install(FILES ${FLEXKV_BASH_COMPLETION} DESTINATION ${CMAKE_INSTALL_DATAROOTDIR}/bash-completion/completions
          RENAME flexkvctl)
endif()

# README, docs/*.md (flexkvd.service's Documentation= is operations.md) and the engine-side example project.
install(FILES ${PROJECT_SOURCE_DIR}/README.md DESTINATION ${FLEXKV_INSTALL_DOCDIR})
file(GLOB FLEXKV_DOCS ${PROJECT_SOURCE_DIR}/docs/*.md ${PROJECT_SOURCE_DIR}/docs/*.png)
install(FILES ${FLEXKV_DOCS} DESTINATION ${FLEXKV_INSTALL_DOCDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/examples/engine_cmake DESTINATION ${FLEXKV_INSTALL_DOCDIR}/examples)
# Which transfer backends this build has, for the operator (the Debian package's description says the same).
if(FLEXKV_HAVE_CUDA)
  set(FLEXKV_BUILD_BACKENDS "host cuda")
  set(FLEXKV_BUILD_CUDA_RUNTIME "libcudart.so.${CUDAToolkit_VERSION_MAJOR} (CUDA ${CUDAToolkit_VERSION})")
else()
  set(FLEXKV_BUILD_BACKENDS "host")
  set(FLEXKV_BUILD_CUDA_RUNTIME "none")
endif()
file(CONFIGURE OUTPUT ${PROJECT_BINARY_DIR}/install/BUILDINFO CONTENT
  "version=${PROJECT_VERSION}\nbackends=${FLEXKV_BUILD_BACKENDS}\ncuda_runtime=${FLEXKV_BUILD_CUDA_RUNTIME}\n")
install(FILES ${PROJECT_BINARY_DIR}/install/BUILDINFO DESTINATION ${FLEXKV_INSTALL_DOCDIR})

# Everything the rules above take from the build, to build just that before installing or packaging
# (scripts/test_package.sh: `ninja flexkv_install_inputs`, then cpack).
add_custom_target(flexkv_install_inputs)
add_dependencies(flexkv_install_inputs flexkvd flexkvctl flexkv-bench flexkv ${FLEXKV_PYTHON_MODULES})
foreach(target flexkv_man flexkv_completion)
  if(TARGET ${target})
    add_dependencies(flexkv_install_inputs ${target})
  endif()
endforeach()

include(${CMAKE_CURRENT_LIST_DIR}/deb_package.cmake)

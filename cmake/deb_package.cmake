# The Debian package (`cpack` in build/, or `cpack --config build/CPackConfig.cmake`): flexkvd_<version>_amd64.deb
# from the install rules of cmake/install.cmake, with the maintainer scripts of packaging/debian/.
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME flexkvd)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_PACKAGE_CONTACT "flexkvd maintainers <flexkvd@localhost>")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # flexkvd_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_SECTION misc)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
# Debian ships stripped binaries (the debug info of a RelWithDebInfo build stays in build/). gzip: compressing the
# binaries with xz would cost more than the rest of the package stage.
set(CPACK_STRIP_FILES ON)
set(CPACK_DEBIAN_COMPRESSION_TYPE gzip)
# Runtime libraries from dpkg-shlibdeps on the installed binaries (libgrpc++, libprotobuf, libsystemd, liburing, ...).
# Libraries that no Debian package provides (a CUDA toolkit installed by NVIDIA's installer) are skipped by it: the
# description says which CUDA runtime a GPU build needs. python3: the Python package; systemd: its sysusers and
# tmpfiles run from postinst (the units need it anyway).
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "python3 (>= 3.10), systemd")
# The shlibs file for libflexkv.so.0 (so that packages built against it get a dependency on this one).
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
# A GPU build and a CPU-only build are different packages under one name: the description's first line says which,
# and /usr/share/doc/flexkvd/BUILDINFO lists the backends (cmake/install.cmake).
if(FLEXKV_HAVE_CUDA)
  set(flexkv_deb_build "GPU build: host and CUDA backends; needs ${FLEXKV_BUILD_CUDA_RUNTIME} and the NVIDIA driver")
else()
  set(flexkv_deb_build "CPU-only build: host backend (no CUDA)")
endif()
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "node-local KV-cache daemon for LLM inference (${flexkv_deb_build})")
# CPack puts the summary first and indents the rest.
set(CPACK_DEBIAN_PACKAGE_DESCRIPTION "flexkvd owns a node's host KV-cache pool, its prefix index and its transfer engine, \
and serves every engine process on the node through libflexkv (C++ API and C ABI) and the Python package flexkvd.
This package installs the daemon, flexkvctl, flexkv-bench, libflexkv with its headers, pkg-config and CMake files, \
the Python package, the systemd units (enabled by nobody: systemctl enable --now flexkvd.socket) and the flexkv \
system user.")
# Maintainer scripts and the ldconfig trigger; /etc/flexkvd/flexkvd.toml is a conffile (kept on remove, removed on
# purge, never overwritten when the operator changed it).
set(flexkv_deb_control ${PROJECT_BINARY_DIR}/install/debian)
file(MAKE_DIRECTORY ${flexkv_deb_control})
foreach(script postinst prerm postrm triggers)
  configure_file(${PROJECT_SOURCE_DIR}/packaging/debian/${script} ${flexkv_deb_control}/${script} COPYONLY)
endforeach()
file(CONFIGURE OUTPUT ${flexkv_deb_control}/conffiles CONTENT "${FLEXKV_INSTALL_SYSCONFDIR}/flexkvd/flexkvd.toml\n")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA ${flexkv_deb_control}/postinst ${flexkv_deb_control}/prerm
    ${flexkv_deb_control}/postrm ${flexkv_deb_control}/triggers ${flexkv_deb_control}/conffiles)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_OUTPUT_FILE_PREFIX ${PROJECT_BINARY_DIR}/package)
include(CPack)

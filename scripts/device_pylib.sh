# Sourced by the scripts/device_*.sh recipes that run Python (torch) beside the bundled binaries.
# flexkv_python_libdir BUNDLE: prints a new directory of links to the bundle's libraries except the ones Python must
# take from the machine (its newer libstdc++ and the system libraries), so that Python's library path holds only the
# project's own dependencies (gRPC, protobuf, abseil, libflexkv...).
flexkv_python_libdir() {
  local bundle=$1 dir f
  dir=$(mktemp -d)
  for f in "$bundle"/lib/*; do
    case $(basename "$f") in
      libstdc++*|libgcc_s*|libz.so*|libssl*|libcrypto*|liblzma*|libzstd*|liblz4*|libsystemd*|libgcrypt*|libgpg-error*|libcap.so*) ;;
      *) ln -s "$(realpath "$f")" "$dir/" ;;
    esac
  done
  echo "$dir"
}

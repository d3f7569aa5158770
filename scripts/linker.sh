#!/bin/sh
# The linker cargo calls for this workspace (.cargo/config.toml): the C compiler, as by
# default, with LLVM's ld.lld where it is installed (Debian's `lld`): a binary linking
# libtorch's many symbols links in about 0.2 s instead of 3.5 s with the system's ld, and a
# test run links about sixty. The user crates the tests build as a user would
# (tests/user_crate.rs) link with the system's default instead.
if command -v ld.lld >/dev/null 2>&1; then
    exec cc -fuse-ld=lld "$@"
fi
exec cc "$@"

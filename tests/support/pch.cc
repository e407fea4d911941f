// Empty: the target exists to build the tests' precompiled header (tests/CMakeLists.txt).

// Keeps flare_train buildable before any of its parts exist (see CMakeLists.txt).

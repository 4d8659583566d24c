// flexkvctl completion: shell completion scripts generated from flexkvctl's own CLI11 definitions, so they list
// exactly the subcommands and options the binary accepts.
#pragma once

#include <CLI/CLI.hpp>
#include <map>
#include <string>
#include <vector>

namespace flexkvctl {

// The values a subcommand's positional argument takes, by subcommand name (e.g. completion: bash, zsh).
using PositionalChoices = std::map<std::string, std::vector<std::string>>;

// A bash script defining _flexkvctl and registering it (`complete -F _flexkvctl flexkvctl`): the subcommands
// first, then each subcommand's options and positional choices; after an option that takes a value, file names
// for --socket and nothing for the others. Source it, or install it as
// /usr/share/bash-completion/completions/flexkvctl.
std::string BashCompletion(const CLI::App& app, const PositionalChoices& choices);

// The same for zsh, through zsh's bashcompinit (put `source <(flexkvctl completion zsh)` in ~/.zshrc).
std::string ZshCompletion(const CLI::App& app, const PositionalChoices& choices);

}  // namespace flexkvctl

"""Shell completion for drpo-analyze, drpo-lab and drpo-train, written from their own parsers (so
a new flag completes without a list kept by hand): flags, their choices, file arguments, and an
objective as a shipped name or a .dsl file. drpo-train completes its --drpo.* flags only
(OpenRLHF's own are its parser's, built when it runs)."""
from __future__ import annotations

import argparse

import dsl

# flags whose value is a file or folder: completed from the file system
PATHS = {"--plot", "--out", "--drpo.objective", "--drpo.step_log", "--drpo.plugin_config"}


def _flags(parser: argparse.ArgumentParser) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """(every flag, {flag: its choices}, the flags that take a value)."""
    flags, choices, valued = [], {}, []
    for action in parser._actions:      # argparse's own record of what it parses (no public one)
        for flag in action.option_strings:
            flags.append(flag)
            if action.choices:
                choices[flag] = [str(c) for c in action.choices]
            if action.nargs != 0:
                valued.append(flag)
    return flags, choices, valued


def _command(name: str, parser: argparse.ArgumentParser) -> str:
    flags, choices, valued = _flags(parser)
    cases = [f'            {flag}) COMPREPLY=($(compgen -W "{" ".join(c)}" -- "$cur")); return;;'
             for flag, c in choices.items()]
    cases += [f"            {flag}) COMPREPLY=($(compgen -f -- \"$cur\")); return;;" for flag in valued
              if flag in PATHS and flag not in choices and flag != "--drpo.objective"]
    rest = [flag for flag in valued if flag not in choices and flag not in PATHS]
    if rest:
        cases.append(f"            {'|'.join(rest)}) return;;")
    return (f"        {name})\n            flags=\"{' '.join(flags)}\"\n            case \"$prev\" in\n"
            + "\n".join(cases) + "\n            esac;;")


def script(analyze_parser: argparse.ArgumentParser, shell: str = "bash") -> str:
    from openrlhf_drpo.hosts.openrlhf.launch import add_drpo_flags
    from openrlhf_drpo.lab.driver import parser as lab_parser
    train = argparse.ArgumentParser(prog="drpo-train", add_help=True)
    train.add_argument("--version", action="store_true")
    add_drpo_flags(train)
    commands = [("drpo-analyze", analyze_parser), ("drpo-lab", lab_parser()), ("drpo-train", train)]
    head = "autoload -U +X bashcompinit && bashcompinit\n" if shell == "zsh" else ""
    return head + f"""# drpo-analyze --completion {shell}: completion for drpo-analyze, drpo-lab and drpo-train
_drpo_complete() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}" flags
    case "${{COMP_WORDS[0]##*/}}" in
{chr(10).join(_command(name, p) for name, p in commands)}
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$flags" -- "$cur"))
    else    # an objective: a shipped name or a .dsl file
        COMPREPLY=($(compgen -W "{' '.join(dsl.shipped_names())}" -- "$cur") $(compgen -f -X '!*.dsl' -- "$cur")
                   $(compgen -d -- "$cur"))
    fi
}}
complete -o filenames -F _drpo_complete drpo-analyze drpo-lab drpo-train"""

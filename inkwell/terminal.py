"""The command lines' consoles (`inkwell ...`, the demo): one kind, so every command prints the same way.

Soft-wrapped: a line longer than the terminal (a path, an API key, an export to paste, a log line) is left whole
for the terminal to wrap. Rich's default breaks it with newlines at the console's width (80 columns when the output
is a pipe or a file), and a copy, a `grep` or a saved log keeps the broken lines.
"""

from rich.console import Console


def console(stderr: bool = False) -> Console:
    """A console for standard output, or for standard error with `stderr`."""
    return Console(soft_wrap=True, stderr=stderr)


def print_plain(to: Console, message: str, style: str | None = None) -> None:
    """`message` as written, in `style` if given: a name, a path or an error's text in it is not read as rich markup
    (`[b]...`) nor coloured by rich's highlighter."""
    to.print(message, style=style, markup=False, highlight=False)


def print_error(to: Console, message: str) -> None:
    """`message` in red, as written."""
    print_plain(to, message, "red")

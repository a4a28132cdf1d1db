"""The ``transformer-bridge`` command line (also ``python -m transformer_bridge``): subcommands and their
arguments (`main`), one flag per declared generation option (`options`), and the interactive prompt loop
(`repl`).

Open this folder to add a subcommand or a flag. It sits above everything else and may import any part of the
package; nothing imports it. Heavy imports (torch, transformers) happen only when a command runs, so ``--help``
stays fast.
"""

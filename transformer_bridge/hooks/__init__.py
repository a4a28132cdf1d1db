"""Hook points and everything a hook sees: the `HookPoint` and its handles (`points`), the registry behind
``add_hook`` / ``hooks()`` / ``reset_hooks`` (`registry`), what a registered function is and may return
(`checks`, `entries`), the one hook-name grammar (`names`), the context a hook reads (`context`), and declarative
steering (`steering`).

Open this folder to add a kind of hook, a name spelling or a field of ``hook.ctx``. Its modules import only each
other and torch: nothing here knows about HF modules, caches or generation, so every other folder may build on it.
"""

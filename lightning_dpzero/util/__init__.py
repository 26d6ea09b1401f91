"""What every part uses and no part owns: the string options and their one check (``options.py``), the ranks as
the DP pieces see them (``collectives.py``), all-or-nothing file writes (``atomic.py``), a package's names imported
when used (``lazy.py``), and the library warnings a user cannot act on (``known_warnings.py``). Imports nothing."""

"""The operator's wing: what the commands show on the console.

:mod:`.console` (what is printed, and where the libraries' logs go instead) and :mod:`.startup_progress` (one line
per start-up phase, with its seconds). It imports nothing else of ``services``: the cluster wing and the commands
print through it.
"""

"""One communication layer for every collective and point-to-point call the runtime makes.

:mod:`.layer` is the entry point (``from paratrain.runtime.comm import layer as comm``;
``comm.all_reduce(t, group, axis=..., purpose=...)``): it times and logs each call and routes it
by the tuning table; :mod:`.backends` builds the second communicators a table routes to;
:mod:`.log` writes ``train --comm-log``; :mod:`.table` reads the tuning table and :mod:`.tune`
measures it (``paratrain comm tune``). Importing this package does not import torch (the table
reader serves the CLI's checks); the modules that need it import it themselves.
"""

"""Child interpreters whose SIGINT is Python's default, as when a program is started from a terminal.

A test run started in the background by a non-interactive shell (``cmd &``, ``nohup``) inherits an ignored SIGINT,
and Python keeps it ignored: metricbus then leaves SIGINT alone (its Ctrl-C deferral goes only over Python's default
handler), and a test of that deferral would test nothing. Its child scripts begin with this line instead.
"""

SIGINT_DEFAULT = "import signal as _signal; _signal.signal(_signal.SIGINT, _signal.default_int_handler)\n"

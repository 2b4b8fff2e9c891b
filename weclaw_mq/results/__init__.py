"""The results side of an App: its tasks' records read and waited for, their streams and
session inboxes, and cancels (``reader.ResultsReader``), over ``state/`` and ``streaming/``."""

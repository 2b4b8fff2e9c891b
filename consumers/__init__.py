"""Runnable example workers. ``consumers.demo:app`` is the one ``make demo`` runs."""

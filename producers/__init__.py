"""Runnable example producers: a FastAPI app that answers 202 + task id, and a plain script."""

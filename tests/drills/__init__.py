"""Fault drills: real processes killed with SIGKILL, services restarted (marker: drill)."""

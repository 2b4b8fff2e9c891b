"""The message contract: headers and their values, names, messages, task ids, lifetimes."""

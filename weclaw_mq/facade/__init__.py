"""``App``'s public methods by topic, each documented once and carried out by the part that
does the work: registering handlers, hooks and schedules (``registration``), reading what
tasks did (``reading``), workflows and costs (``workflows_and_costs``), the local outbox
(``local_outbox``). ``app.App`` inherits them and keeps publishing, its stores and its
lifecycle."""

"""The publishing side of an App: ``engine.PublishingEngine`` (prepare, route, confirmed
publish, batches, the declare at the first publish, the local outbox) and the "queued" records
written beside each publish (``queued_records``)."""

"""Apps that integration tests run as real worker processes (``weclaw-mq worker ...``)."""

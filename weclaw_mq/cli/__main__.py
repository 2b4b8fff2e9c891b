"""``python -m weclaw_mq.cli``: the same as the installed ``weclaw-mq`` script."""

from weclaw_mq.cli import main

main()

"""``python -m weclaw_mq.cli``: the same as the installed ``weclaw-mq`` script."""

from . import main

main()

"""Settings of the example shop: PostgreSQL from ``SHOP_DB_*`` (the machine's by default)."""

import os

SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "an example key, not for production")
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "producers.django_shop.urls"
INSTALLED_APPS = ["producers.django_shop"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("SHOP_DB_NAME", "postgres"),
        "USER": os.environ.get("SHOP_DB_USER", "postgres"),
        "HOST": os.environ.get("SHOP_DB_HOST", "127.0.0.1"),
        "PORT": os.environ.get("SHOP_DB_PORT", "5432"),
        # The schema of the shop's tables and of weclaw_outbox.
        "OPTIONS": {"options": f"-c search_path={os.environ.get('SHOP_DB_SCHEMA', 'public')}"},
    }
}

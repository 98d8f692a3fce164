import os

from django.conf import settings

from workflow_delivery.api.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "buzz_project.settings")

# Each request's synchronous code on one of a few long-lived threads, so their
# database connections are reused (workflow_delivery.api.asgi).
application = get_asgi_application(threads=settings.ASGI_THREADS)

"""Mount with ``path("agents/", include("workflow_delivery.api.urls"))``."""

from django.urls import path

from .views import api

urlpatterns = [path("", api.urls)]

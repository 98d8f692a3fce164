"""Mount with ``path("agents/", include("workflow_delivery.api.urls"))``."""

from django.urls import path

from . import docs_view
from .views import api

urlpatterns = [
    path("v1/docs", docs_view.api_docs, name="workflow_delivery_api_docs"),
    path("", api.urls),
]

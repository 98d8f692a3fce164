from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics", include("workflow_delivery.metrics")),
    path("agents/", include("workflow_delivery.api.urls")),
]

"""Operator permissions: each admin action on deliveries and each community lifecycle
move has its own permission, so granting one never grants another."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("workflow_delivery", "0004_delivery_transition_guard"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="community",
            options={
                "ordering": ["host"],
                "permissions": [
                    ("begin_community_deletion", "Can begin the deletion of a community"),
                    ("fence_community", "Can fence a quiescing community"),
                    ("tombstone_community", "Can tombstone a fenced community"),
                    (
                        "cancel_community_deletion",
                        "Can cancel the deletion of a quiescing community",
                    ),
                ],
                "verbose_name_plural": "communities",
            },
        ),
        migrations.AlterModelOptions(
            name="workflowagentdelivery",
            options={
                "ordering": ["-created_at", "id"],
                "permissions": [
                    ("reap_deliveries", "Can reap expired delivery leases"),
                    ("release_delivery", "Can release the lease of a claimed delivery"),
                    ("fail_delivery", "Can mark a delivery failed (operator terminal)"),
                ],
                "verbose_name": "workflow agent delivery",
                "verbose_name_plural": "workflow agent deliveries",
            },
        ),
    ]

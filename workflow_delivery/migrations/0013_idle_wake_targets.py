"""The idle registry of wake-ups: the (community, target) pairs whose consumers found
nothing to claim and wait for a notification.

A consumer (or an API ``wait``) that found nothing upserts its pairs here after it
listens and before its last poll; a producer's insert deletes the pairs of the rows it
created and notifies only those, in the same statement. Busy or absent consumers
register nothing, so their producers send no notification at all.

The table is UNLOGGED: its rows are hints, never data. A crash empties it, which only
leaves the next commit unannounced until a consumer polls (every listener's session is
lost with the crash too, and a listener that reconnects polls first). It is a tenant
table like the others: it references its community, carries the community write fence,
and ``purge_community`` deletes its rows.
"""

import django.contrib.postgres.functions
import django.db.models.deletion
import django.db.models.functions.text
import django.db.models.lookups
from django.db import migrations, models

TABLE = "workflow_delivery_idle_wake_targets"


class Migration(migrations.Migration):
    dependencies = [
        ("workflow_delivery", "0012_replay_guard_global"),
    ]

    operations = [
        migrations.CreateModel(
            name="IdleWakeTarget",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "community_id",
                        "target_pubkey",
                        blank=True,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("target_pubkey", models.BinaryField()),
                (
                    "registered_at",
                    models.DateTimeField(
                        db_default=django.contrib.postgres.functions.TransactionNow(),
                        editable=False,
                    ),
                ),
                (
                    "community",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="workflow_delivery.community",
                    ),
                ),
            ],
            options={
                "db_table": TABLE,
                "constraints": [
                    models.CheckConstraint(
                        condition=django.db.models.lookups.Exact(
                            django.db.models.functions.text.Length("target_pubkey"), 32
                        ),
                        name="wd_idle_wake_target_32_bytes",
                    )
                ],
            },
        ),
        migrations.RunSQL(
            sql=(
                f"ALTER TABLE {TABLE} SET UNLOGGED;\n"
                f"ALTER TABLE {TABLE} ADD CONSTRAINT wd_idle_wake_target_community_fk "
                "FOREIGN KEY (community_id) REFERENCES communities (id) ON DELETE CASCADE;"
            ),
            reverse_sql=(
                f"ALTER TABLE {TABLE} DROP CONSTRAINT wd_idle_wake_target_community_fk;\n"
                f"ALTER TABLE {TABLE} SET LOGGED;"
            ),
        ),
        migrations.RunSQL(
            sql=(
                "CREATE TRIGGER wd_community_write_fence BEFORE INSERT OR UPDATE OR DELETE "
                "ON workflow_delivery_idle_wake_targets FOR EACH ROW EXECUTE FUNCTION wd_enforce_community_write_fence();"
            ),
            reverse_sql="DROP TRIGGER wd_community_write_fence ON workflow_delivery_idle_wake_targets;",
        ),
    ]

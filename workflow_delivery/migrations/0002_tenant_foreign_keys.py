"""Tenant-scoped foreign keys: every reference carries community_id, so a row can
never point at another community's row. The ORM cannot declare composite keys,
hence reviewed SQL; each constraint is named for what it guards."""

from django.db import migrations

FOREIGN_KEYS = [
    # (table, constraint, columns, referenced table, referenced columns, on delete)
    ("workflows", "wd_workflow_community_fk", "community_id", "communities", "id", "RESTRICT"),
    ("workflow_runs", "wd_run_community_fk", "community_id", "communities", "id", "RESTRICT"),
    (
        "workflow_runs",
        "wd_run_workflow_fk",
        "community_id, workflow_id",
        "workflows",
        "community_id, id",
        "CASCADE",
    ),
    ("events", "wd_event_community_fk", "community_id", "communities", "id", "RESTRICT"),
    (
        "workflow_agent_deliveries",
        "wd_delivery_community_fk",
        "community_id",
        "communities",
        "id",
        "RESTRICT",
    ),
    (
        "workflow_agent_deliveries",
        "wd_delivery_workflow_fk",
        "community_id, workflow_id",
        "workflows",
        "community_id, id",
        "CASCADE",
    ),
    (
        "workflow_agent_deliveries",
        "wd_delivery_run_fk",
        "community_id, workflow_id, run_id",
        "workflow_runs",
        "community_id, workflow_id, id",
        "CASCADE",
    ),
    (
        "workflow_agent_deliveries",
        "wd_delivery_message_event_fk",
        "community_id, message_event_created_at, message_event_id",
        "events",
        "community_id, created_at, id",
        "CASCADE",
    ),
]

EVENT_TAGS_CHECK = """
ALTER TABLE events ADD CONSTRAINT wd_event_tags_string_lists CHECK (
    jsonb_typeof(tags) = 'array'
    AND NOT jsonb_path_exists(tags, 'strict $[*] ? (@.type() != "array")', '{}', true)
    AND NOT jsonb_path_exists(tags, 'strict $[*][*] ? (@.type() != "string")', '{}', true)
);
"""


def _add(table, name, columns, target, target_columns, on_delete):
    return (
        f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY ({columns}) "
        f"REFERENCES {target} ({target_columns}) ON DELETE {on_delete};"
    )


class Migration(migrations.Migration):
    dependencies = [("workflow_delivery", "0001_initial")]

    operations = [
        migrations.RunSQL(
            sql=_add(*fk),
            reverse_sql=f"ALTER TABLE {fk[0]} DROP CONSTRAINT {fk[1]};",
        )
        for fk in FOREIGN_KEYS
    ] + [
        migrations.RunSQL(
            sql=EVENT_TAGS_CHECK,
            reverse_sql="ALTER TABLE events DROP CONSTRAINT wd_event_tags_string_lists;",
        )
    ]

"""A message's content may be a JSON value: ``events.content_json`` holds it, and
``content`` its encoding (the text the event id covers). Text content leaves
``content_json`` NULL, as every existing row does.

``wd_event_content_json_is_content``: a row holding a JSON value holds it in both
columns, equal as ``jsonb`` compares them (a CASE, so text content is never parsed as
JSON).

Not atomic, so the constraint is added ``NOT VALID`` under a brief lock and then
validated while writes go on (validation takes a lock that does not block them);
each step can be run again after a failure.
"""

from django.db import migrations, models
from django.db.models import Q
from django.db.models.functions import Cast

FORWARD = [
    "ALTER TABLE events ADD COLUMN IF NOT EXISTS content_json jsonb NULL",
    """ALTER TABLE events
        DROP CONSTRAINT IF EXISTS wd_event_content_json_is_content,
        ADD CONSTRAINT wd_event_content_json_is_content
            CHECK (CASE WHEN content_json IS NULL THEN true
                        ELSE content_json = content::jsonb END) NOT VALID""",
    "ALTER TABLE events VALIDATE CONSTRAINT wd_event_content_json_is_content",
]

REVERSE = [
    "ALTER TABLE events DROP CONSTRAINT IF EXISTS wd_event_content_json_is_content",
    "ALTER TABLE events DROP COLUMN IF EXISTS content_json",
]


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("workflow_delivery", "0021_operator_retry")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(FORWARD, REVERSE)],
            state_operations=[
                migrations.AddField(
                    model_name="event",
                    name="content_json",
                    field=models.JSONField(blank=True, null=True),
                ),
                migrations.AddConstraint(
                    model_name="event",
                    constraint=models.CheckConstraint(
                        condition=Q(content_json__isnull=True)
                        | Q(content_json=Cast("content", models.JSONField())),
                        name="wd_event_content_json_is_content",
                    ),
                ),
            ],
        )
    ]

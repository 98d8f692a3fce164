"""A delivery row that is cheaper to write and keeps every rule.

* ``wd_delivery_workflow_fk`` goes. ``wd_delivery_run_fk`` already references
  ``(community_id, workflow_id, id)`` of ``workflow_runs``, and ``wd_run_workflow_fk``
  makes that run's ``(community_id, workflow_id)`` an existing workflow: a delivery
  naming a workflow that is not its run's workflow, or none at all, is refused by the
  run key. Deleting a workflow deletes its runs (``wd_run_workflow_fk`` cascades) and
  their deliveries (``wd_delivery_run_fk`` cascades), so the cascade the dropped key
  gave is still there. Every insert checked both keys; now only the one.
* ``wd_delivery_community_fk`` goes, for the same reason: the run key makes
  ``(community_id, workflow_id, run_id)`` a run of that community, and
  ``wd_run_community_fk`` makes the community exist. Deleting a community that still
  has deliveries is still refused (its runs refuse it: ``wd_run_community_fk`` is
  RESTRICT, and a delivery cannot outlive its run). The dropped key cost every insert
  a lookup and a ``FOR KEY SHARE`` lock on the community row, the one row every
  producer of a community shares.
* ``wd_delivery_workflow_idx`` goes. It served only the dropped key's cascade; the
  run key's cascade finds a run's deliveries through ``wd_delivery_identity_key``
  ``(community_id, run_id, …)``. One index fewer on every insert and on every
  transition that rewrites the row outside HOT (every claim, finish and reap: they
  change ``status``, a column of the partial indexes' predicates).
* fillfactor stays at 100 (measured, ``bench/fillfactor.py``): a transition changes
  ``status`` or ``lease_until``, both indexed, so no delivery update is ever HOT and
  free space left in a page would only make the table larger.
"""

from django.db import migrations

DROP_WORKFLOW_FK = "ALTER TABLE workflow_agent_deliveries DROP CONSTRAINT wd_delivery_workflow_fk;"
RESTORE_WORKFLOW_FK = """
ALTER TABLE workflow_agent_deliveries ADD CONSTRAINT wd_delivery_workflow_fk
    FOREIGN KEY (community_id, workflow_id) REFERENCES workflows (community_id, id)
    ON DELETE CASCADE;
"""

DROP_COMMUNITY_FK = (
    "ALTER TABLE workflow_agent_deliveries DROP CONSTRAINT wd_delivery_community_fk;"
)
RESTORE_COMMUNITY_FK = """
ALTER TABLE workflow_agent_deliveries ADD CONSTRAINT wd_delivery_community_fk
    FOREIGN KEY (community_id) REFERENCES communities (id) ON DELETE RESTRICT;
"""


class Migration(migrations.Migration):
    dependencies = [("workflow_delivery", "0008_agent_request_replay")]

    operations = [
        migrations.RunSQL(sql=DROP_WORKFLOW_FK, reverse_sql=RESTORE_WORKFLOW_FK),
        migrations.RunSQL(sql=DROP_COMMUNITY_FK, reverse_sql=RESTORE_COMMUNITY_FK),
        migrations.RemoveIndex(model_name="workflowagentdelivery", name="wd_delivery_workflow_idx"),
    ]

"""examples/k8s/ parse as the Kubernetes objects they claim to be: every pod template,
Job template and claim by the `kubernetes` client's own models (unknown fields
refused); the custom resources' own fields (PyTorchJob, JobSet) by a schema of
the fields their CRDs define."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from kubernetes.client import models

from tests.schedulers import manifest

REPLICA = {
    "type": "object", "additionalProperties": False, "required": ["template"],
    "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {"type": "object"},  # a PodTemplateSpec: checked by the client's model
    },
}
PYTORCHJOB = {  # kubeflow.org/v1 PyTorchJob (training operator v1)
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"}, "kind": {"const": "PyTorchJob"},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["pytorchReplicaSpecs"],
            "properties": {
                "nprocPerNode": {"type": "string"},
                "elasticPolicy": {"type": "object"},
                "runPolicy": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "activeDeadlineSeconds": {"type": "integer"},
                        "backoffLimit": {"type": "integer"},
                        "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                        "managedBy": {"type": "string"}, "schedulingPolicy": {"type": "object"},
                        "suspend": {"type": "boolean"}, "ttlSecondsAfterFinished": {"type": "integer"},
                    },
                },
                "pytorchReplicaSpecs": {
                    "type": "object", "additionalProperties": False, "required": ["Master"],
                    "properties": {"Master": REPLICA, "Worker": REPLICA},
                },
            },
        },
    },
}
JOBSET = {  # jobset.x-k8s.io/v1alpha2 JobSet
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"}, "kind": {"const": "JobSet"},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["replicatedJobs"],
            "properties": {
                "replicatedJobs": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "required": ["name", "template"],
                    "properties": {"name": {"type": "string"}, "replicas": {"type": "integer"},
                                   "dependsOn": {"type": "array"},
                                   "template": {"type": "object"}},  # a JobTemplateSpec
                }},
                "network": {"type": "object", "additionalProperties": False, "properties": {
                    "enableDNSHostnames": {"type": "boolean"}, "subdomain": {"type": "string"},
                    "publishNotReadyAddresses": {"type": "boolean"}}},
                "failurePolicy": {"type": "object", "additionalProperties": False, "properties": {
                    "maxRestarts": {"type": "integer"}, "restartStrategy": {"type": "string"},
                    "rules": {"type": "array"}}},
                "successPolicy": {"type": "object"}, "startupPolicy": {"type": "object"},
                "coordinator": {"type": "object"}, "suspend": {"type": "boolean"},
                "managedBy": {"type": "string"}, "ttlSecondsAfterFinished": {"type": "integer"},
            },
        },
    },
}


def test_pytorchjob_is_a_pytorchjob() -> None:
    job = manifest("pytorchjob.yaml")
    jsonschema.validate(job, PYTORCHJOB)
    models.V1ObjectMeta.model_validate(job["metadata"])
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        template = models.V1PodTemplateSpec.model_validate(replica["template"])
        assert template.spec is not None
        # The operator finds its container and the master's port by these names.
        assert [c.name for c in template.spec.containers] == ["pytorch"]
    (master,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert "pytorchjob-port" in [p["name"] for p in master["ports"]]


def test_jobset_is_a_jobset() -> None:
    jobset = manifest("jobset.yaml")
    jsonschema.validate(jobset, JOBSET)
    models.V1ObjectMeta.model_validate(jobset["metadata"])
    for replicated in jobset["spec"]["replicatedJobs"]:
        job = models.V1JobTemplateSpec.model_validate(replicated["template"])
        assert job.spec is not None and job.spec.completion_mode == "Indexed"


def test_claim_is_a_persistent_volume_claim() -> None:
    claim = models.V1PersistentVolumeClaim.model_validate(manifest("pvc.yaml"))
    assert claim.kind == "PersistentVolumeClaim" and claim.spec is not None
    assert claim.spec.access_modes == ["ReadWriteMany"]  # every pod of the job mounts it


@pytest.mark.parametrize("bad", [
    {"spec": {"containers": [{"name": "pytorch", "workdir": "/x"}]}},  # misspelt field
    {"spec": {"containers": [{"name": "pytorch", "ports": [{"containerPort": "http"}]}]}},
    {"spec": {"containers": [{"image": "no-name"}]}},  # a container needs a name
])
def test_the_models_refuse_what_kubernetes_would(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        models.V1PodTemplateSpec.model_validate(bad)


def test_the_crd_schemas_refuse_a_misspelt_field() -> None:
    job = manifest("pytorchjob.yaml")
    job["spec"]["nProcPerNode"] = job["spec"].pop("nprocPerNode")
    with pytest.raises(jsonschema.ValidationError, match="nProcPerNode"):
        jsonschema.validate(job, PYTORCHJOB)
    jobset = manifest("jobset.yaml")
    jobset["spec"]["network"]["enableDnsHostnames"] = True
    with pytest.raises(jsonschema.ValidationError, match="enableDnsHostnames"):
        jsonschema.validate(jobset, JOBSET)

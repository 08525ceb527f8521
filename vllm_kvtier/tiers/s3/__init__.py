"""The S3 tier.

It has the store (store.py), its byte primitives (medium.py) and its start-up listing
(scan.py). It has its object I/O contract and boto3 engine (object_io.py), and its config
and error classification (config.py). The manifests that index its chunks are in
manifest.py. boto3 is imported only when a store opens.
"""

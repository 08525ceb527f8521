"""The S3 tier: the store (store.py), its byte primitives (medium.py), its start-up
listing (scan.py), its object I/O contract and boto3 engine (object_io.py), its config and
error classification (config.py), and the manifests that index its chunks (manifest.py).
boto3 is imported only when a store opens.
"""

"""NIXL: the P/D peer agent (agent.py, used by transfer/peer.py) and NIXL as the I/O
engine of the NVMe and S3 tiers (io_engine.py). nixl is imported only when used.
"""

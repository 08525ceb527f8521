"""The Mooncake tier: the store over a Mooncake pool (store.py). The mooncake
package is imported only when a store opens.
"""

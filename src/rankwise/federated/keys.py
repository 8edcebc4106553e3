"""Every key that the ServerApp and the ClientApp must both spell, in one place.

Flower messages carry a ``RecordDict``; these constants name its records and the entries of
the config and metric records. Nothing else in rankwise spells these strings.
"""
from __future__ import annotations

# --- records inside a message's RecordDict ------------------------------------------------
ARRAYS = "arrays"          # ArrayRecord: adapter tensors (down: global values, up: update)
CONFIG = "config"          # ConfigRecord: what the client must do this round
METRICS = "metrics"        # MetricRecord: what the client reports
STATE = "rankwise-adapter"  # ArrayRecord kept in a node's Context.state between rounds
STATE_STRUCTURE = "rankwise-structure"  # ConfigRecord in Context.state: FedLEASE layout
STATE_SYNC = "rankwise-sync"            # ConfigRecord in Context.state: round last received

# --- the app's run config ([tool.flwr.app.config]) and node config -------------------------
RUN_CONFIG_FILE = "rankwise-config"  # str: path of the rankwise run config (YAML)
RUN_OUT = "rankwise-out"             # str: run folder the ServerApp writes

# --- ConfigRecord entries (server -> client) ------------------------------------------------
ROUND = "server-round"     # int: current round (Flower's own spelling)
TRAIN_FACTORS = "train-factors"  # str: "AB", "A" or "B": which LoRA factors train
TRAIN_LAYERS = "train-layers"    # list[int]: layer indices that train; empty = all layers
TRAIN_STEPS = "train-steps"      # int: local optimiser steps this round
LEARNING_RATE = "learning-rate"  # float
SYNC_ROUND = "sync-round"        # int: round of the last payload this node was sent (0: none)
FULL_SYNC = "full-sync"          # bool: the payload holds every global tensor
INIT_FINGERPRINT = "init-fingerprint"  # str: hash of the initial adapter (first contact)
RESYNC_REASON = "rankwise-resync"      # marker in a client's error: its adapter copy is lost
PHASE = "phase"                  # str: "train", "warmup" (FedLEASE), "oneshot" (YOCO); in a
#                                  query: IDENTIFY (answer only the partition id)
IDENTIFY = "identify"
CLUSTER = "cluster"              # int: FedLEASE expert/cluster index of the receiving client
NUM_EXPERTS = "num-experts"      # int: FedLEASE number of experts M
TOP_M = "top-m"                  # int: FedLEASE router selects at most M of 2M-1 slots
YOCO_SIGN_WEIGHT = "yoco-sign-weight"      # float
YOCO_GAMMA_MAX = "yoco-gamma-max"          # float
YOCO_SPARSE_WEIGHT = "yoco-sparse-weight"  # float

# --- MetricRecord entries (client -> server) -----------------------------------------------
NUM_EXAMPLES = "num-examples"    # weight of a client in every weighted mean (Flower's spelling)
TRAIN_LOSS = "train-loss"
PARTITION = "partition-id"       # the client's data partition (maps node ids to data)
CAPACITY = "capacity"            # LEFF: layers the client can train (reply; node_config key)
CAPACITIES = "capacities"        # LEFF: list[int] capacity per partition id (query config)
IMPORTANCE = "layer-importance"  # LEFF: per-layer first-order Taylor importance (list)
IMPORTANCE_S = "importance-s"     # LEFF: seconds the client's importance pass took (reply)
REFRESH = "refresh-importance"    # LEFF: bool, measure importance again this round (train config)

# --- MetricRecord entries of a round (strategy -> Flower's history) ------------------------
BYTES_UP = "bytes-up"
BYTES_DOWN = "bytes-down"
AGGREGATED = "clients-aggregated"

# --- key prefixes inside the ArrayRecord for multi-part payloads (FedLEASE) -----------------
EXPERT_PREFIX = "expert{m}/"     # expert m's LoRA tensors: "expert0/<plain factor name>"
CLUSTER_PREFIX = "cluster{c}/"   # cluster c's routers and head: "cluster0/<parameter name>"
ROUTER_PREFIX = "cluster{c}/router/"  # cluster c's router of the layer whose A factor is
#                                       <plain A name>: "cluster0/router/<plain A name>"

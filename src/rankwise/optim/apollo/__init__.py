"""APOLLO optimizers; importing registers ``apollo`` and ``apollo-mini``."""
from rankwise import registry
from rankwise.optim.apollo.config import ApolloConfig, ApolloMiniConfig
from rankwise.optim.apollo.optimizer import ApolloAdamW, apollo_state_floats, build_apollo, random_basis

# lr_grid: the lowrank-pretrain sweep (around the authors' 1e-2 for LLaMA pre-training).
registry.register("optimizer", "apollo", ApolloConfig, build_apollo,
                  summary="APOLLO: channel-wise gradient scaling from Adam moments of a random projection (2nr state)",
                  state_floats=apollo_state_floats, lr_grid=(3e-3, 1e-2, 3e-2))
registry.register("optimizer", "apollo-mini", ApolloMiniConfig, build_apollo,
                  summary="APOLLO-Mini: rank-1 random projection, one gradient scale per matrix (2n state)",
                  state_floats=apollo_state_floats, lr_grid=(3e-3, 1e-2, 3e-2))

__all__ = ["ApolloAdamW", "ApolloConfig", "ApolloMiniConfig", "build_apollo", "random_basis"]

"""lightning-fedhet on Flower: FedVARP (or FedAvg, MIFA, FedAU) with Lightning clients on Fashion-MNIST."""

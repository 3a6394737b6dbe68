"""FPPDM / FPPDM++ (Liu, Chen et al., IJCAI 2023): the domain core (Gaussian LightGCN trainer), the
closed-form W2 barycenter in plaintext and over Paillier, compactness co-clustering, and the
server's round core (`rounds`) that the Flower strategy adapts."""

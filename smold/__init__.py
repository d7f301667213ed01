"""smol: disposable KVM microVMs for agent evaluation."""

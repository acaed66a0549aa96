// Command kube-scheduler is upstream's default kube-scheduler, built from the k8s.io/kubernetes
// module (the gang tests let the process kubelet run only the pods it binds).
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics, as upstream's main
	_ "k8s.io/component-base/metrics/prometheus/version"  // the version metric, as upstream's main
	"k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	os.Exit(cli.Run(app.NewSchedulerCommand()))
}

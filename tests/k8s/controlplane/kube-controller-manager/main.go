// Command kube-controller-manager is upstream's kube-controller-manager, built from the
// k8s.io/kubernetes module (the tests need its StatefulSet and garbage-collector controllers).
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics, as upstream's main
	_ "k8s.io/component-base/metrics/prometheus/version"  // the version metric, as upstream's main
	"k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func main() {
	os.Exit(cli.Run(app.NewControllerManagerCommand()))
}

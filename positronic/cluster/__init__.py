"""The server on Ray Serve (`positronic serve --replicas N`, docs/cluster.md): replicas of the
plain server behind one endpoint, sessions routed to the replica that holds them, a shared store
to fail over from. Ray is an optional extra: nothing outside this package imports it, and this
package is imported only by `serve --replicas`."""

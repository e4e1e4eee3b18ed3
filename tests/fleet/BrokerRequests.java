// The request counts of local Kafka brokers, by API, as the brokers count them (JMX), for `make fleet`.
//
// Run with the JDK's single-file launcher: `java BrokerRequests.java PID [PID...]`. It attaches to each broker
// JVM (the Attach API: same user, same host), starts its local JMX agent, prints {"ready": true}, then for
// every line read on stdin prints one JSON line {"PID": {"Fetch": n, "ListOffsets": n, ...}, ...}: the
// cumulative Count of kafka.network:type=RequestMetrics,name=RequestsPerSec per request type (summed over
// the version tag). Exits when stdin closes. Read-only: it changes nothing in the brokers.
import com.sun.tools.attach.VirtualMachine;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import javax.management.MBeanServerConnection;
import javax.management.ObjectName;
import javax.management.remote.JMXConnectorFactory;
import javax.management.remote.JMXServiceURL;

public class BrokerRequests {
    public static void main(String[] args) throws Exception {
        List<MBeanServerConnection> brokers = new ArrayList<>();
        for (String pid : args) {
            VirtualMachine vm = VirtualMachine.attach(pid);
            String address = vm.startLocalManagementAgent();
            vm.detach();
            brokers.add(JMXConnectorFactory.connect(new JMXServiceURL(address)).getMBeanServerConnection());
        }
        ObjectName pattern = new ObjectName("kafka.network:type=RequestMetrics,name=RequestsPerSec,*");
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        System.out.println("{\"ready\": true}");
        System.out.flush();
        while (in.readLine() != null) {
            StringBuilder out = new StringBuilder("{");
            for (int i = 0; i < brokers.size(); i++) {
                Map<String, Long> counts = new TreeMap<>();
                for (ObjectName name : brokers.get(i).queryNames(pattern, null)) {
                    Object count = brokers.get(i).getAttribute(name, "Count");
                    counts.merge(name.getKeyProperty("request"), ((Number) count).longValue(), Long::sum);
                }
                out.append(i == 0 ? "" : ", ").append('"').append(args[i]).append("\": {");
                String sep = "";
                for (Map.Entry<String, Long> e : counts.entrySet()) {
                    out.append(sep).append('"').append(e.getKey()).append("\": ").append(e.getValue());
                    sep = ", ";
                }
                out.append('}');
            }
            System.out.println(out.append('}'));
            System.out.flush();
        }
    }
}
